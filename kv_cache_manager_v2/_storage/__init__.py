"""Pool layout, slot allocation and memory backends."""
