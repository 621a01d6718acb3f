"""The paged KV cache: block pool, radix tree, exact index, eviction policies and the facade.

Import from the submodules (`kvchat.cache.kvcache`, ...): this package stays import-light so that
tools reading only a snapshot (`kvchat inspect`) do not pay for torch.
"""
