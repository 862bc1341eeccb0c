"""Pure planners: bucket packing, the capacity model, NIC and reader assignment (plain data in and out)."""
