"""Runnable jobs that use lightning_ext, kept outside the package (run from the repository root).

``python -m examples.digits`` (the main job, ``make demo``), ``python -m examples.gan``,
``python -m examples.fabric_digits``; each takes ``--help``. They need the ``examples`` extra:
``pip install -e ".[examples]"``.
"""
