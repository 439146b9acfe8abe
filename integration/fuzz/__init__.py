"""Bad-input suites against real processes: the agent, the broker and the mesh, fed raw bytes.

Every suite drives a real process over its real socket with hypothesis-made
inputs (random bytes, mutated valid messages, huge fields, unknown fields,
invalid UTF-8 in map entries) and checks what a client and an operator see:
a clear status for each call, a process that keeps serving, and nothing
left behind. ``wire`` holds the protobuf wire encoder and the strategies.
"""
