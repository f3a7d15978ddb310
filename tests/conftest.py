"""The whole suite runs offline, as its machines do: the Hugging Face hub is never asked (a model id that is not
in the local cache fails at once instead of after the client's connection retries, about 20 s each), in this
process and in every job it starts (they inherit the environment)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
