// examples/train_copy/train_copy.cpp: trains the copy model of model.hpp from scratch and
// prints the falling loss and the final accuracy on fresh sequences.
//
//   train_copy [--steps N]     (default 200; ctest runs --steps 100)
//
// Exits non-zero if, after at least 100 steps, fewer than 95% of the held-out predictions
// are right (the PyTorch twin, train_copy.py, is past 99% after 50 steps).
#include <cstdlib>
#include <exception>
#include <iomanip>
#include <iostream>
#include <string>

#include "model.hpp"

int main(int argc, char** argv) {
  try {
    long steps = 200;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--steps" && i + 1 < argc) {
        steps = std::stol(argv[++i]);
      } else {
        std::cerr << "usage: train_copy [--steps N]\n";
        return 2;
      }
    }
    const train_copy::Config config;
    train_copy::SplitMix64 rng(config.seed);
    train_copy::Model model(config, rng);
    train_copy::Adam adam(config);
    std::cout << "copy " << config.length << " symbols of " << config.symbols << ": "
              << config.layers << " attention layers, E " << config.embed_dim << ", H "
              << config.num_heads << ", batch " << config.batch << ", Adam lr " << config.lr
              << "\n";
    std::cout << std::fixed;
    for (long step = 0; step < steps; ++step) {
      const train_copy::StepResult r = model.run(train_copy::make_batch(config, rng), true);
      adam.step(model.params(), r.grads);
      model.load_layers();
      if (step % 25 == 0 || step == steps - 1) {
        std::cout << "step " << std::setw(4) << step << "  loss " << std::setprecision(6) << r.loss
                  << "  accuracy " << std::setprecision(3) << r.accuracy << "\n";
      }
    }
    double accuracy = 0;
    const int held_out = 4;
    for (int i = 0; i < held_out; ++i)
      accuracy += model.run(train_copy::make_batch(config, rng), false).accuracy / held_out;
    std::cout << "held-out accuracy " << std::setprecision(3) << accuracy << " over "
              << held_out * config.batch << " new sequences\n";
    if (steps >= 100 && accuracy < 0.95) {
      std::cerr << "train_copy: the model did not learn to copy\n";
      return EXIT_FAILURE;
    }
    return EXIT_SUCCESS;
  } catch (const std::exception& error) {
    std::cerr << "train_copy: " << error.what() << "\n";
    return EXIT_FAILURE;
  }
}
