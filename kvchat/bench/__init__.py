"""Benchmarks behind `kvchat bench`: pure functions returning small typed results, plus Rich
renderers of those results. `cache` needs no model (one figure uses one if given); `engine`
measures requests on a loaded model."""
