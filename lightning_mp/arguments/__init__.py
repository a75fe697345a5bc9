"""The package's argument handling.

The checks that name a bad argument, its value and what is allowed are :mod:`~lightning_mp.arguments.checks`; the
settings fields that carry their own documentation and check are :mod:`~lightning_mp.arguments.setting_docs`.
"""
