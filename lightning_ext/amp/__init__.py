"""lightning_ext.amp"""

__all__: list[str] = []
