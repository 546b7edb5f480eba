// The fixture loading and the comparisons of support/fixtures.hpp, compiled once:
// mha.json alone holds millions of numbers.
#include <fstream>
#include <map>
#include <stdexcept>

#include "support/fixtures.hpp"

namespace attn_test {

const json& fixture(const std::string& name) {
  static std::map<std::string, json> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    std::ifstream in(std::string(ATTN_FIXTURE_DIR) + "/" + name);
    if (!in)
      throw std::runtime_error("cannot open fixture " + name);
    it = cache.emplace(name, json::parse(in)).first;
  }
  return it->second;
}

double number(const json& x) {
  if (x.is_string()) {
    const std::string s = x.get<std::string>();
    if (s == "inf")
      return std::numeric_limits<double>::infinity();
    if (s == "-inf")
      return -std::numeric_limits<double>::infinity();
    if (s == "nan")
      return std::numeric_limits<double>::quiet_NaN();
    throw std::runtime_error("bad fixture number " + s);
  }
  return x.get<double>();
}

std::vector<Index> shape_of(const json& t) {
  return t.at("shape").get<std::vector<Index>>();
}

std::vector<double> values_of(const json& t) {
  const json& data = t.at("data");
  std::vector<double> out;
  out.reserve(data.size());
  for (const json& x : data)
    out.push_back(number(x));
  return out;
}

ATTN_TEST_COMPARE_INSTANCES(, float, double)
ATTN_TEST_COMPARE_INSTANCES(, double, double)
ATTN_TEST_COMPARE_INSTANCES(, float, long double)
ATTN_TEST_COMPARE_INSTANCES(, double, long double)

}  // namespace attn_test
