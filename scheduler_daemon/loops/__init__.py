"""The daemon's loops: ``publish`` and ``plugin``, each a :class:`LoopWork` run by a
:class:`LoopRunner`."""
