"""Leaves of the package: the serve config file (`config.py`), TLS (`tls.py`) and the machine
description (`machine.py`). They import nothing of the project; every other layer may import them."""
