// The tokenizers live in tokenizer/ (torch-free); the model layer's names for them.
#pragma once

#include "tokenizer/tokenizer.h"

namespace flywheel::model {
using tokenizer::ByteTokenizer;
using tokenizer::CharTokenizer;
using tokenizer::Tokenizer;
}  // namespace flywheel::model
