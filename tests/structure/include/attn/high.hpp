#pragma once
inline int five_lines(int x) {
  const char* brace = "}";  // a brace in a string is not one
  x += 1;
  return x + (brace != nullptr);
}
inline int short_one() {
  return 1;
}
