"""Model families, one file each, and the registry that picks one from config.json."""
