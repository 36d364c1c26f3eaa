"""The ``inferhal`` command line; one module ``cmd_<name>.py`` per command (see main.py)."""
