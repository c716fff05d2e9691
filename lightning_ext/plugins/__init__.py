"""lightning_ext.plugins"""

__all__: list[str] = []
