"""Draft families behind one small registry (DFlash today; DFlash 2 is the next file)."""
