"""The P2P path: the metas document, the Mooncake store, updates into a subset of ranks."""
