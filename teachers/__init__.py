"""Teacher domains for MOPD: (domain, effort) -> model directory + engine. Registered by decorator."""
