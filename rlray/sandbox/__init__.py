"""Untrusted Python run in an isolated child process (the code reward and python_tool);
launcher.py is the child's first program."""
