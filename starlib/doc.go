// Package starlib holds the Go-native Starlark modules that rollout scripts load:
//
//	load("@slimen//answers.star", "boxed", "equal", "grade")  // Answers
//	load("@slimen//text.star", "tag", "strip_think", "f1")    // Text
//	load("@slimen//vote.star", "majority")                    // Vote
//	load("@slimen//stats.star", "mean", "std", "zscore")      // Stats
//	load("@slimen//random.star", "randint", "choice")         // Random
//	load("@std//json.star", "encode", "decode")               // go.starlark.net/lib/json
//	load("@std//math.star", "sqrt", "log")                    // go.starlark.net/lib/math
//
// A host's loader gets them from Packages (package → file → globals) or one at a time from
// Module(pkg, file); a load binds the module's members as the file's globals. Each module is also
// exported as a *starlarkstruct.Module (Answers, Text, …) for hosts that predeclare modules.
//
// Random numbers are per thread, never global: the host calls SetRandom(thread, TaskSeed(runSeed,
// step, taskID)) on every rollout thread and ForkRandom for the threads of parallel(), so a rerun
// with the same seed draws the same numbers. random.star and the tie-break of vote.majority use
// that generator and fail with a clear error on a thread that has none.
//
// Every built-in unpacks its arguments with starlark.UnpackArgs and prefixes its errors with its
// qualified name ("answers.grade: …"). The work is done by plain Go functions (Grade, SlimeEqual,
// SlimeBoxed, SlimeExtract, F1, Normalize, Equal, Tag, StripThink, …) that embedders may call
// directly. The graders reproduce slime's rm_hub (slime_graders.go): testdata/slime/rewards.jsonl
// holds slime's verdicts, written by the script beside it, and TestSlimeRewardVectors checks them.
package starlib
