// The entry point of the per-part link checks (cmake/xctx_parts.cmake): never run; the link
// itself is the check.
int main() { return 0; }
