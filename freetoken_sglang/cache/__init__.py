"""The GPU expert cache: slot memory and its layout, residency bookkeeping, and fills (paper §3, §4.1)."""
