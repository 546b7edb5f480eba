#pragma once
#include "attn/high.hpp"
