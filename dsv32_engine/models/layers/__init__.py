"""DeepSeek-V3.2 decoder layers.

Each module does model math only. Anything that depends on the batch's
layout (lengths, slots, page tables, schedules) is read from the plan the
planner built, never recomputed here, so 61 layers cost one metadata build.
"""
