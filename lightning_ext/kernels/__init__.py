"""lightning_ext.kernels"""

__all__: list[str] = []
