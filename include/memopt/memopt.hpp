// memopt/memopt.hpp — the umbrella header: the Trainer, its policies, memory tracking,
// the building blocks and the LLaMA model. Data and tokenizer headers are separate
// (memopt/data/*.hpp) because the tokenizer needs SentencePiece.
#pragma once

#include "memopt/batch.hpp"
#include "memopt/callbacks.hpp"
#include "memopt/concepts.hpp"
#include "memopt/error.hpp"
#include "memopt/io/pretrained.hpp"
#include "memopt/io/safetensors.hpp"
#include "memopt/memory/report.hpp"
#include "memopt/memory/rss.hpp"
#include "memopt/memory/tracker.hpp"
#include "memopt/models/llada.hpp"
#include "memopt/models/llama.hpp"
#include "memopt/nn/attention.hpp"
#include "memopt/nn/mlp.hpp"
#include "memopt/nn/rmsnorm.hpp"
#include "memopt/nn/rope.hpp"
#include "memopt/optim/clip.hpp"
#include "memopt/optim/param_groups.hpp"
#include "memopt/optim/schedule.hpp"
#include "memopt/policies/accum.hpp"
#include "memopt/policies/checkpoint.hpp"
#include "memopt/policies/offload.hpp"
#include "memopt/policies/precision.hpp"
#include "memopt/runtime.hpp"
#include "memopt/trainer.hpp"
