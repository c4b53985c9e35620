"""The sharding core: layout, communication, buckets and stage engines. Imports torch only, never lightning."""
