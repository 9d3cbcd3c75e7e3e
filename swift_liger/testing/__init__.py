"""Offline helpers for tests, the demo and examples (tiny random models, toy datasets). Not imported by the
patcher or the plugin."""
