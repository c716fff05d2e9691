"""lightning_ext.examples"""

__all__: list[str] = []
