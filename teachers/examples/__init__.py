"""Worked examples of custom teacher domains (not registered unless listed under `plugins:`)."""
