"""Overflow forensics on the host: analysis of the device's overflow record, reports, autofix."""
