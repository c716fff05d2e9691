"""lightning_ext.nn"""

__all__: list[str] = []
