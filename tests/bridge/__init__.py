"""The public bridge API (`hf_mcore_bridge.bridge`)."""
