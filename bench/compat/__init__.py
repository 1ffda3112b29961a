"""Compatibility checks: standard clients run against `shardline up`."""
