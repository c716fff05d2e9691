"""lightning_ext.callbacks"""

__all__: list[str] = []
