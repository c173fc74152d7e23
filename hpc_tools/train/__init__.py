"""The programs that run on every rank, one module (or package) per backend kind."""
