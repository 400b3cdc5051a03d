"""jaxckpt's tests, a folder per package: ``tests/<package>/test_<feature>.py`` (``tests/house/`` checks the whole
tree). Every folder is a package, so two folders may hold files of the same name; shared helpers import as
``tests.numerics``, ``tests.own_models``."""
