"""Target families behind one registry: one file per family, plus what they share."""
