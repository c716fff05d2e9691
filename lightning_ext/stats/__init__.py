"""lightning_ext.stats"""

__all__: list[str] = []
