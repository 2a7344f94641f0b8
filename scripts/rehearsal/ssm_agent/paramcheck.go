// paramcheck validates SSM document parameter values the way the SSM agent does, with Go's
// own regexp package, so that a pattern Go refuses is caught before a document is deployed.
//
// Rules mirrored from aws/amazon-ssm-agent:
//   - agent/framework/docparser/paramvalidator/allowedregexparamvalidator/
//     allowedregexparamvalidator.go: regexp.Compile(parameter.AllowedPattern), then
//     MatchString(value) (unanchored: a pattern must carry its own ^ and $);
//   - agent/framework/docparser/paramvalidator/minmaxcharparamvalidator/
//     minmaxcharparamvalidator.go: minChars/maxChars bound len(value).
//
// Input (stdin): a JSON list of {"pattern", "minChars", "maxChars", "value"}; value may be
// null to only compile the pattern. Output (stdout): a JSON list of {"error"}, null when the
// value (or the pattern alone) is accepted.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
)

type check struct {
	Pattern  string  `json:"pattern"`
	MinChars *int    `json:"minChars"`
	MaxChars *int    `json:"maxChars"`
	Value    *string `json:"value"`
}

type result struct {
	Error *string `json:"error"`
}

func validate(c check) *string {
	fail := func(format string, args ...interface{}) *string {
		text := fmt.Sprintf(format, args...)
		return &text
	}
	if c.Pattern != "" {
		re, err := regexp.Compile(c.Pattern)
		if err != nil {
			return fail("encountered error while compiling allowed pattern - internal error: %v", err)
		}
		if c.Value != nil && !re.MatchString(*c.Value) {
			return fail("parameter value /%v/ does not match the allowed pattern /%v/", *c.Value, c.Pattern)
		}
	}
	if c.Value != nil {
		if c.MinChars != nil && len(*c.Value) < *c.MinChars {
			return fail("parameter value /%v/ is shorter than minChars %d", *c.Value, *c.MinChars)
		}
		if c.MaxChars != nil && len(*c.Value) > *c.MaxChars {
			return fail("parameter value /%v/ is longer than maxChars %d", *c.Value, *c.MaxChars)
		}
	}
	return nil
}

func main() {
	var checks []check
	if err := json.NewDecoder(os.Stdin).Decode(&checks); err != nil {
		fmt.Fprintln(os.Stderr, "paramcheck: cannot read the checks:", err)
		os.Exit(2)
	}
	results := make([]result, len(checks))
	for i, c := range checks {
		results[i] = result{Error: validate(c)}
	}
	if err := json.NewEncoder(os.Stdout).Encode(results); err != nil {
		fmt.Fprintln(os.Stderr, "paramcheck:", err)
		os.Exit(2)
	}
}
