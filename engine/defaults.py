"""Where the embedded default model and its draft live inside the package."""

import os

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_MODEL = os.path.join(ASSETS_DIR, "kjv-llama")
DEFAULT_DRAFT_MODEL = os.path.join(ASSETS_DIR, "kjv-llama-draft")
