// The training example (examples/train_copy): the C++ training's first steps against the
// same model trained by PyTorch (examples/train_copy/train_copy.py, which wrote
// tests/reference/train_copy.json): same initial weights, data and Adam steps in float64,
// the losses within 1e-11 relative (5e-16 measured with
// GCC at -O1) at every one of the 12 steps.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "../examples/train_copy/model.hpp"
#include "support/fixtures.hpp"
TEST_CASE("train_copy: the C++ training follows PyTorch's losses step by step", "[train]") {
  const attn_test::json& fixture = attn_test::fixture("train_copy.json");
  const attn_test::json& c = fixture.at("config");
  const train_copy::Config config;
  // The fixture was written for this configuration.
  REQUIRE(c.at("symbols").get<attn::Index>() == config.symbols);
  REQUIRE(c.at("length").get<attn::Index>() == config.length);
  REQUIRE(c.at("embed_dim").get<attn::Index>() == config.embed_dim);
  REQUIRE(c.at("num_heads").get<attn::Index>() == config.num_heads);
  REQUIRE(c.at("layers").get<attn::Index>() == config.layers);
  REQUIRE(c.at("batch").get<attn::Index>() == config.batch);
  REQUIRE(c.at("lr").get<double>() == config.lr);
  REQUIRE(c.at("seed").get<std::uint64_t>() == config.seed);
  const attn_test::json& losses = fixture.at("losses");
  REQUIRE(losses.size() == 12);

  train_copy::SplitMix64 rng(config.seed);
  train_copy::Model model(config, rng);
  train_copy::Adam adam(config);
  for (std::size_t step = 0; step < losses.size(); ++step) {
    INFO("step " << step);
    const train_copy::StepResult r = model.run(train_copy::make_batch(config, rng), true);
    const double expected = losses[step].get<double>();
    CHECK(std::abs(r.loss - expected) <= 1e-11 * expected);
    adam.step(model.params(), r.grads);
    model.load_layers();
  }
  // The loss falls from chance (ln 17 = 2.83).
  CHECK(losses[11].get<double>() < 0.95 * losses[0].get<double>());
}
