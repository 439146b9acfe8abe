"""Test nodes as kind makes them, without Docker: a Debian root booted with systemd as PID 1 under systemd-nspawn."""
