"""Step policies by name: what the CLI's `--branch-policy` and `--policy`
build, for the engine and the simulator alike.

Built-in order, when several run: branch admission first (it decides which
rows exist), then speculation length (it decides how long they are), then
any policy given by name (observers such as the online
latency refit see the plan as it will run).
"""

from __future__ import annotations

from stepserve.scheduler.branch_admission import BranchAdmissionPolicy, BranchAdmissionSpec
from stepserve.scheduler.policy import NoopPolicy
from stepserve.scheduler.speculation import SETTLE, SpecLengthPolicy, SpecLengthSpec


def branch_admission_policy(spec: str | BranchAdmissionSpec, *, latency_model=None, slo_ttft_s: float | None = None,
                            slo_tpot_s: float | None = None, costs=None) -> BranchAdmissionPolicy | None:
    """The branch-admission policy of `spec`, or None for `eager` (every row
    runs: the plan needs no policy). `costs`: the profile's `ServingCosts`
    (TAPER prices cold decode steps with them)."""
    spec = BranchAdmissionSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.mode == "eager":
        return None
    return BranchAdmissionPolicy(spec, latency_model=latency_model, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                                 costs=costs)


def speculation_policy(spec: str | SpecLengthSpec, *, latency_model=None, replay=None,
                       propose=None, settle: int = SETTLE, quiet: int = 0) -> SpecLengthPolicy | None:
    """The speculation-length policy of `spec`, or None for `none`. `replay`:
    a deterministic proposer's `matches_for` (`NgramProposer.matches_for`), which
    the adaptive length replays on the sequences' history; `propose`: its
    `propose_for`, which drafts in the policy, before the step's slots are
    reserved; `settle`: the adaptive length's default `settle`; `quiet`: its
    unsteady plain steps (`SpecLengthPolicy`)."""
    spec = SpecLengthSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.mode == "none":
        return None
    return SpecLengthPolicy(spec, latency_model=latency_model, replay=replay, propose=propose, settle=settle,
                            quiet=quiet)


def make_policy(name: str, *, latency_model=None, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                costs=None):
    """`noop`, or `branch:SPEC` (SPEC as `--branch-policy` takes it)."""
    if name == "noop":
        return NoopPolicy()
    head, _, rest = name.partition(":")
    if head == "branch" and rest:
        return BranchAdmissionPolicy(rest, latency_model=latency_model, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                                     costs=costs)
    raise ValueError(f"unknown step policy {name!r} (noop, branch:eager|off|cap:N|taper[:rho=R,utility=U])")


def policy_stats(policies) -> dict:
    """The merged `stats()` of the policies that report any."""
    out: dict = {}
    for p in policies:
        stats = getattr(p, "stats", None)
        if stats is not None:
            out.update(stats())
    return out
