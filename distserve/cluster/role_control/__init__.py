"""Roles that follow the load: the role controller and its settings."""
