// A tiny test harness for the torch-free C++ core (no gtest: the CI box has no network).
//
// TEST(name) { ... } registers a test; CHECK(cond) and CHECK_EQ(a, b) record a failure and keep
// going; CHECK_THROWS(stmt, Type) expects an exception. main() in each test file calls
// run_tests(argc, argv): with no argument it runs every test, with one it runs the named test
// (that is how CMakeLists.txt registers each test with ctest). Exit status 0 means all passed.
#pragma once

#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace harness {

struct Test {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Test>& tests() {
  static std::vector<Test> all;
  return all;
}

inline int& failures() {
  static int count = 0;
  return count;
}

struct Register {
  Register(const char* name, std::function<void()> body) { tests().push_back({name, body}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
}

template <typename A, typename B>
void check_eq(const A& a, const B& b, const char* expr, const char* file, int line) {
  if (a == b) return;
  std::ostringstream out;
  out << expr << " (" << a << " vs " << b << ")";
  fail(file, line, out.str());
}

inline int run_tests(int argc, char** argv) {
  int ran = 0;
  for (const Test& t : tests()) {
    if (argc > 1 && std::strcmp(argv[1], t.name) != 0) continue;
    const int before = failures();
    try {
      t.body();
    } catch (const std::exception& e) {
      fail(t.name, 0, std::string("uncaught exception: ") + e.what());
    }
    std::printf("[%s] %s\n", failures() == before ? "  OK  " : " FAIL ", t.name);
    ++ran;
  }
  if (ran == 0) {
    std::fprintf(stderr, "no test named %s\n", argc > 1 ? argv[1] : "(any)");
    return 2;
  }
  return failures() == 0 ? 0 : 1;
}

}  // namespace harness

#define HARNESS_CONCAT2(a, b) a##b
#define HARNESS_CONCAT(a, b) HARNESS_CONCAT2(a, b)
#define TEST(name)                                                        \
  static void name();                                                     \
  static harness::Register HARNESS_CONCAT(register_, name)(#name, &name); \
  static void name()

#define CHECK(cond) ((cond) ? (void)0 : harness::fail(__FILE__, __LINE__, "CHECK(" #cond ")"))
#define CHECK_EQ(a, b) harness::check_eq((a), (b), #a " == " #b, __FILE__, __LINE__)
#define CHECK_THROWS(stmt, Type)                                                    \
  do {                                                                              \
    bool thrown_ = false;                                                           \
    try {                                                                           \
      stmt;                                                                         \
    } catch (const Type&) {                                                         \
      thrown_ = true;                                                               \
    }                                                                               \
    if (!thrown_) harness::fail(__FILE__, __LINE__, #stmt " did not throw " #Type); \
  } while (0)
