"""Native CPU kernels: small C files built at install into cffi extension modules (``build.py``)
and called through ``native.py``. The torch paths stay the reference and the fallback."""
