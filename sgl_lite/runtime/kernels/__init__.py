"""sgl_lite's C++ CPU kernels: the sources, the one loader that builds them and says which ops exist, thin wrappers."""
