"""Models: where one comes from and how it is loaded (`loading`), GGUF files (`gguf`, `precision`),
which architectures can be paged (`architectures`), weights packed to int8 / int4 (`quant`), chat
templates (`chat_template`) and the messages a failed load turns into (`load_errors`).

Import from the submodules: this package stays import-light, and only `loading` and `quant` touch
torch (inside the functions that need it)."""
