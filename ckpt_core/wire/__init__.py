"""The PS <-> engine-worker wire: our protocol, the PS end of a socket, the stock codec, the engine-side loop."""
