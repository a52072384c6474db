"""The dependency-free core: value types and errors that several layers share.

Modules here import only the standard library, numpy and pydantic, never another part of
``ragstream``, so that storage, embedding, retrieval and the APIs can all depend on them without
importing each other (``tests/test_import_layers.py`` holds the layer order).
"""

__all__: list[str] = []
