"""Native CPU kernels: small C files compiled once per machine with the system's C compiler and
called through ctypes (``native.py``). The torch paths stay the reference and the fallback."""
