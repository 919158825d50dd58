#!/bin/bash
sed -i -e 's/Helo/Hello/' -e 's/\$nme/$name/' /app/greet.sh
